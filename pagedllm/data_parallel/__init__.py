"""Data-parallel serving: engine replicas as Ray actors behind one server, routed by prefix affinity."""
