"""Pure decisions (no I/O): TTL budget, keep-alive schedule, routing, prediction."""
