"""Alerts: burn-rate and regression alerts with a pending → firing → resolved lifecycle, silences, diagnosis."""
