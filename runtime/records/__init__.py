"""The runtime's records: its ledger writer, status, metrics and admin socket."""
