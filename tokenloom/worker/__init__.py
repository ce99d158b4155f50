"""One worker per rank: its set-up phases, the model runner and the state it keeps between steps."""
