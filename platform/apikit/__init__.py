"""The API kit every app's JSON API is built with: the django-ninja application, its errors, token auth and the
declared input types (one input layer for the API and the dashboard's forms)."""
