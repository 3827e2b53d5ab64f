"""The runtime's status, assembled from what the replicas' machines and the monitors say (reads
only: the replica never imports it), and its text for people."""
