"""Pytest fixtures for the sqs test server; filled in with the sqs adapter."""
