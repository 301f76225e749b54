"""Schedules scored on held-out contexts: paired tables, realism against real digits, figures."""
