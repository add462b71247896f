"""`kvstash bench resume`: time to first token of a resumed session, kvstash against recompute and its floors."""
