"""The web dashboard: server-rendered pages (Django templates, htmx for partial updates, uPlot for charts)."""
