"""Shared types below every layer: domain types, errors with their own code enum,
lifecycle rules, admission limits and the log format. Imports nothing of the package."""
