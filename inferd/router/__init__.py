"""`inferd router`: an OpenAI-compatible proxy over several servers, routing by cache affinity.

policy.py (`make_policy`: the policies, also used in-process), radix.py (the approximate tree),
kv_index.py (exact mode's block index), keys.py (request → routing key), workers.py (health),
proxy.py (forwarding, retries), kv_subscriber.py, metrics.py, app.py, cli.py.
"""
