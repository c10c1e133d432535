"""Keys: the one set of key operations (``ops``), secrets and headers (``auth``) and who a request
is (``access``); the stores they work on are ``serve_app.state.keys``."""
