"""Accounting: usage, audit, stage timing, traces and their export."""
