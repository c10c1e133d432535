"""Admission: may this request run, and what it holds while it runs (limits, budgets, flow queue, capacity, drain, the books)."""
