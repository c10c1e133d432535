"""What a replica process does for itself, gateway or model alike: flush its log at once
(logflush), run at the priority its job needs (niceness), watch its event loop and CPU (procwatch).
Imports only the standard library and ``serve_app.metrics``-free protocols."""
