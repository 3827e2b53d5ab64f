"""The runtime's records: the ledger's writer thread (generations, recycles, failures, and what it
measures of its traffic and processes), the books status reads (recent failures and recycles,
the failure window) and the hold file. The replica writes through `replica.ports` Protocols and
never imports this package."""
