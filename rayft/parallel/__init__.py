"""How a run is spread over its workers: expert parallelism, and the tally of bytes that moved between them."""
