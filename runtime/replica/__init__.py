"""One replica: its state machine, what it decides from (triggers, strategy; the hang rule is core.hang), its monitors."""
