"""Pytest fixtures for the kafka test server; filled in with the kafka adapter."""
