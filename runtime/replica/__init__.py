"""One replica: its state machine, what it decides from (triggers, strategy, hang), its monitors."""
