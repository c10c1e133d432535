"""Test infrastructure, not load tools: start a stack (stack.py) and break it (faults.py)."""
