"""The runtime's servers besides the proxy: the admin socket (status and commands) and the
Prometheus endpoint. Each is handed what it serves (a status function, the loop's command queue,
the proxy's counters): none assembles or decides anything."""
