"""The enforcer's sockets: the JSON-lines server, the control commands, and the preload shim's side (protocol, broker, credit pages, memory view)."""
