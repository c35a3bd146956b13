"""Service level objectives on the decomposed requests: definitions, burn-rate evaluation, status series."""
