"""``deepinfer bench serve``: an open-loop load generator against a running deployment's OpenAI HTTP endpoint or its
gRPC ``Generation`` API.

Requests arrive on a schedule of their own (a rate, Poisson or bursty, or all at once; optionally at most N in
flight), never waiting for earlier answers, so a slow server shows as growing latency rather than as a slower
client. Prompt and output lengths come from a distribution (``workload``); multi-turn sessions send each turn after
the previous answer, with the conversation so far. Each request's time to first token, inter-token latencies and
end-to-end latency are taken on the client (``clients``), summarised with the metric names of ``vllm bench serve``
(``metrics``), and written as JSON with a plot of their distributions (``report``).
"""
