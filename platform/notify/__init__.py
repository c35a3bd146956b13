"""Notification channels (Standard Webhooks, Alertmanager, Slack, PagerDuty) and reliable, SSRF-safe delivery."""
