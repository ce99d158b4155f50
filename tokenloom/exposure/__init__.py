"""What an HTTP server of tokenloom (`tokenloom serve`, `tokenloom router`) exposes to the network, and on what
terms: cross-origin access (cors.py) and how many connections a client may hold and for how long
(connections.py). Both servers take the same flags from here, so they answer the same way."""
