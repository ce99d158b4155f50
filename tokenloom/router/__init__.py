"""`tokenloom router`: an HTTP proxy in front of several OpenAI-compatible servers (cli.py, app.py),
with round-robin, least-load and cache-aware policies (policy.py), health checks (workers.py),
retries before a response starts and pass-through streaming (proxy.py), its own /metrics
(metrics.py), and a prefill/decode mode (pd.py)."""
