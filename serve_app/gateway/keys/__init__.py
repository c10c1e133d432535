"""Keys: the one key model, its stores and operations, secrets and who a request is."""
