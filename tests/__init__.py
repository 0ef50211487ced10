"""Test suite for the outbox relay; a package so `tests.support` imports the same everywhere."""
