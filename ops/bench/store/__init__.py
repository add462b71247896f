"""`kvstash bench store`: a whole context through BlockStore against raw redis-py, one server or a Cluster."""
