"""The public port: the streaming proxy, where a request goes, what is forwarded, the connection cap."""
