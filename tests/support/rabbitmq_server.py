"""Pytest fixtures for the rabbitmq test server; filled in with the rabbitmq adapter."""
