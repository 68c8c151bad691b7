"""The settings of the services: the KV store, the grammar service, and serving (liveness, admission, security)
(declared once each; read through :mod:`deepinfer.envs`)."""

from __future__ import annotations

from deepinfer.envs.registry import declare

# fmt: off
_KV = "KV store"
declare("DEEPINFER_KVSTORE_URL", "str", _KV, """
    Address (`host:port`) of the kvstore a worker moves prefix-cache resume points to when the device cache
    evicts them, and fetches them from on a later hit (from any replica). Unset: resume points live on the
    device only. `deepinfer up` sets it to the kvstore it starts.""")
declare("DEEPINFER_KVSTORE_HOST_BYTES", "int", _KV, """
    Capacity of the kvstore's host-memory tier in bytes (payload bytes). When a new blob does not fit, the
    least recently used blobs leave host memory (a blob that also has a disk copy stays on disk). 0 keeps
    no blob in memory: every Get reads the disk tier.""",
    default=4 * 1024**3, default_doc="`4294967296` (4 GiB)", minimum=0)
declare("DEEPINFER_KVSTORE_DIR", "path", _KV, """
    Data directory of the kvstore's disk tier: one checksummed file per blob, written through on every Put
    so that blobs survive restarts (indexed again at start). Created if missing. Unset: no disk tier (host
    memory only). `python -m services.kvstore --data-dir` overrides it. `~` is expanded.""")
declare("DEEPINFER_KVSTORE_DISK_BYTES", "int", _KV, """
    Capacity of the kvstore's disk tier in bytes (whole files, headers included). When a new blob does not
    fit, the least recently used files are deleted.""",
    default=64 * 1024**3, default_doc="`68719476736` (64 GiB)", minimum=1)
declare("DEEPINFER_KVSTORE_RETENTION_S", "int", _KV, """
    Seconds a kvstore blob is kept after its last access (Put or Get; Lookup does not count). Older blobs
    are removed from both tiers by a periodic sweep and whenever a Lookup or Get finds them. The default
    is 72 hours.""", default=259200, default_doc="`259200` (72 h)", minimum=1)
declare("DEEPINFER_KVSTORE_MAX_BLOB_BYTES", "int", _KV, """
    Largest blob (total_bytes) the kvstore accepts in a Put; larger ones are refused and counted under
    `deepinfer_kvstore_refused_total{reason="too_large"}`.""",
    default=1024**3, default_doc="`1073741824` (1 GiB)", minimum=1)
declare("DEEPINFER_KVSTORE_SHARED_DIR", "str", _KV, """
    The kvstore's directory for the same-host path: a client on the kvstore's host puts and gets a blob's
    bytes through a file there instead of the gRPC stream (only the header and the file's name cross gRPC):
    1.7-2.3× the stream's rate on a 2-core host (docs/routing.md, "The transfer"). `auto`: a private directory
    under `/dev/shm`, made at start and removed at exit. `off`: none, every transfer streams. A path: that
    directory (made with mode 0700 if missing), e.g. a tmpfs volume mounted into the kvstore's and the
    workers' containers. A client uses it only where it reads the kvstore's probe file there (same host, same
    mount); elsewhere it streams. Files not yet read hold at most `DEEPINFER_KVSTORE_MAX_BLOB_BYTES` × 2
    bytes; one not taken within 60 s is removed.""",
    default="auto")
_GR = "Grammar (structured outputs)"
declare("DEEPINFER_GRAMMAR_URL", "str", _GR, """
    Address (`host:port`) of the grammar service (`python -m services.grammar`) that compiles the
    structured-output constraints of requests (`so_args`, `response_format`, forced tool calls). Unset: no
    grammar service, and a request that needs a grammar is refused as not served here (INVALID_ARGUMENT / HTTP
    400); plain requests never use it.""")
declare("DEEPINFER_UP_GRAMMAR", "bool", _GR, """
    Whether `deepinfer up` starts a grammar service with the mesh (and points the balancer at it). Off (or
    `deepinfer up --no-grammar`): none is started, which saves its processes (each compile process holds
    about 0.4 GB); unless `DEEPINFER_GRAMMAR_URL` names another, structured-output requests are refused and
    tool calls under `tool_choice` auto go unconstrained.""", default=True)
declare("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "float", _GR, """
    Wall-clock limit of one grammar compile in the grammar service, and the cap on a request's own
    `timeout_s`. A compile past it is stopped by killing its compile process (xgrammar cannot cancel one) and
    refused with DEADLINE_EXCEEDED; the process is replaced. The offline engine (`LLM`) bounds each of its
    in-process compiles by it too: past it the request is refused with a ValueError naming this setting (the
    abandoned compile finishes in a background thread).""", default=10.0, minimum=0.01)
declare("DEEPINFER_GRAMMAR_WORKERS", "int", _GR, """
    Number of compile processes of the grammar service (`python -m services.grammar.child`), each compiling
    one grammar at a time.""", default=2, minimum=1)
declare("DEEPINFER_GRAMMAR_MEMORY_BYTES", "int", _GR, """
    Cap on the private memory (heap and anonymous mappings: `RLIMIT_DATA`) of each compile process. A compile
    that needs more fails and is refused; the process is replaced. One process needs about 0.4 GB before it
    compiles anything (xgrammar, torch and the tokenizer).""",
    default=2 * 1024**3, default_doc="`2147483648` (2 GiB)", minimum=512 * 1024**2)
declare("DEEPINFER_GRAMMAR_CACHE_BYTES", "int", _GR, """
    Capacity of the compile cache (serialized compiled grammars, keyed by tokenizer, kind and text), in
    bytes; the least recently used entries leave first. 0 disables the cache.""",
    default=512 * 1024**2, default_doc="`536870912` (512 MiB)", minimum=0)
declare("DEEPINFER_GRAMMAR_MAX_SCHEMA_BYTES", "int", _GR, """
    Largest JSON schema or structural tag (UTF-8 bytes of its text) a grammar compile accepts.""",
    default=1024**2, default_doc="`1048576` (1 MiB)", minimum=1)
declare("DEEPINFER_GRAMMAR_MAX_GRAMMAR_BYTES", "int", _GR, """
    Largest regex or EBNF grammar (UTF-8 bytes): the text of a `regex` or `ebnf` constraint, and each
    `pattern` or grammar inside a JSON schema or structural tag.""",
    default=128 * 1024, default_doc="`131072` (128 KiB)", minimum=1)
declare("DEEPINFER_GRAMMAR_MAX_DEPTH", "int", _GR, """
    Deepest nesting of objects and arrays in a JSON schema or structural tag (the top-level object is depth
    1; each nested schema object adds one or two levels). xgrammar's compile time grows steeply with depth.""",
    default=64, minimum=1)
declare("DEEPINFER_GRAMMAR_MAX_PROPERTIES", "int", _GR, """
    Most `properties` (and `patternProperties`) entries in one JSON schema or structural tag, counted over
    all its objects.""", default=2000, minimum=1)
declare("DEEPINFER_GRAMMAR_MAX_ENUM_VALUES", "int", _GR, """
    Most `enum` values in one JSON schema or structural tag, counted over all its enums.""",
    default=10000, minimum=1)
declare("DEEPINFER_GRAMMAR_MAX_REPEAT", "int", _GR, """
    Largest repetition count (`{n}`, `{n,}`, `{n,m}`) in a regex, an EBNF grammar or a JSON-schema
    `pattern`, and largest `max` of a structural tag's `repeat`.""", default=10000, minimum=1)
declare("DEEPINFER_GRAMMAR_JSON_WHITESPACE", "int", _GR, """
    Whitespace that grammar-constrained JSON may contain. 0: compact JSON, with no whitespace at all
    (separators `,` and `:`). N > 0: at most N whitespace characters in a row wherever JSON allows them
    (structural tags' JSON schemas get at most max(N, 1), xgrammar having no compact mode there). Never
    unbounded, so a schema whose language is finite always terminates.""", default=0, minimum=0, maximum=1024)
declare("DEEPINFER_GRAMMAR_JSON_INDENT", "int", _GR, """
    Indented JSON: N > 0 lays grammar-constrained JSON (`json_schema`, `json_object`) out exactly as
    `json.dumps(value, indent=N)` does — a newline and N spaces per nesting level, `", "` never, `": "` after
    keys — in place of `DEEPINFER_GRAMMAR_JSON_WHITESPACE`'s layout. 0: off. Read where grammars compile
    (the grammar service and the offline engine).""", default=0, minimum=0, maximum=16)
declare("DEEPINFER_GRAMMAR_BACKEND", "enum", _GR, """
    Which engine compiles and enforces `json_schema`, `json_object` and `regex` constraints: `xgrammar` (after
    the schema pass, which rewrites or refuses what xgrammar cannot enforce), `llguidance` (the raw schema;
    llguidance refuses every keyword it does not implement), or `auto`: per schema, xgrammar unless the schema
    pass refuses the schema or xgrammar fails or times out on it, then llguidance on the original schema (a
    refusal of both names the keyword). `ebnf` (xgrammar's GBNF) and `structural_tag` always compile with
    xgrammar; with `DEEPINFER_GRAMMAR_JSON_INDENT` set, `auto` keeps JSON on xgrammar and `llguidance` is
    refused (it cannot lay JSON out indented: the grammar service does not start, the offline engine refuses
    its first constrained request). Read where grammars compile (the grammar service's
    compile processes and the offline engine); part of the compile cache key.""",
    choices=("auto", "xgrammar", "llguidance"), default="auto")
_SRV = "Serving: liveness, admission and security"
declare("DEEPINFER_GRPC_KEEPALIVE_S", "float", _SRV, """
    Interval of the HTTP/2 keepalive pings every gRPC channel of the mesh sends, idle or not. Every gRPC
    server accepts pings from half this interval on (never answering them with GOAWAY `too_many_pings`), so
    an idle mesh keeps its connections for any length of time and notices a dead peer within this interval
    plus `DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S`.""", default=20.0, minimum=0.05)
declare("DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S", "float", _SRV, """
    How long a keepalive ping may go unanswered before the connection is declared dead and its calls fail
    with UNAVAILABLE (then reconnected with backoff).""", default=10.0, minimum=0.05)
declare("DEEPINFER_RECONNECT_MAX_BACKOFF_S", "float", _SRV, """
    Longest wait between two reconnection attempts of a long-lived stream (the scheduler's `Step` stream to
    its worker, the balancer's replica probes, the kvstore and grammar clients). Attempts start at 0.1 s
    and double up to this.""", default=5.0, minimum=0.01)
declare("DEEPINFER_SWITCH_INTERVAL_S", "float", _SRV, """
    Python's thread switch interval (`sys.setswitchinterval`) in the balancer, the schedulers and the workers.
    Each runs its event loop beside threads that compute (the worker's steps, the balancer's detokenization);
    with Python's default of 5 ms an event loop woken by a message can wait up to that long for the GIL, a
    stall of a whole token or more between the scheduler and its worker.""",
    default=0.0005, default_doc="`0.0005` (0.5 ms)", minimum=0.0001, maximum=0.1)
declare("DEEPINFER_WORKER_UNIX_SOCKET", "path", _SRV, """
    A Unix socket the worker serves on besides its TCP port (`python -m services.worker_nvidia
    --unix-socket` overrides it), for a scheduler on the same host (`--worker unix:PATH`): one hop through
    the kernel instead of the TCP stack per step message. The socket file is made readable and writable by
    the worker's user only (mode 0600); calls on it still need the internal token. `deepinfer up` gives each
    co-located worker and scheduler one in a private directory unless TLS is configured (the certificates name
    TCP hosts). Unset: TCP only.""")
declare("DEEPINFER_DRAIN_GRACE_S", "float", _SRV, """
    Seconds a service given SIGTERM lets its in-flight requests finish before it aborts the rest (the
    scheduler's `--grace` overrides it). `deepinfer up` stops the balancer first, then the schedulers,
    then the workers, each within this grace.""", default=30.0, minimum=0.0)
declare("DEEPINFER_API_KEYS", "str", _SRV, """
    Comma-separated API keys of the public APIs (OpenAI HTTP: `Authorization: Bearer KEY`; gRPC
    `deepinfer.v1.Generation`: metadata `authorization: Bearer KEY`). When this and
    `DEEPINFER_API_KEY_FILE` are both unset the public APIs are open, which is only allowed on loopback
    addresses.""")
declare("DEEPINFER_API_KEY_FILE", "path", _SRV, """
    A file of API keys, one per line (blank lines and lines starting with `#` ignored), added to
    `DEEPINFER_API_KEYS`. Re-read when it changes, so keys rotate without a restart.""")
declare("DEEPINFER_INTERNAL_TOKEN", "str", _SRV, """
    Shared secret of the mesh's internal gRPC traffic (scheduler, worker, kvstore, grammar, and the
    balancer's calls to them): every internal call carries it as metadata `x-deepinfer-internal`, and the
    internal services refuse calls without it (UNAUTHENTICATED); admin RPCs (Drain, LoadModel, kvstore
    Put / Delete) need it too. `deepinfer up` generates one. Unset: internal services only accept calls when
    bound to loopback.""")
declare("DEEPINFER_INTERNAL_TOKEN_FILE", "path", _SRV, """
    A file holding the internal token (first line), for secrets mounted as files (Kubernetes); used when
    `DEEPINFER_INTERNAL_TOKEN` is unset.""")
declare("DEEPINFER_ALLOW_UNAUTHENTICATED", "bool", _SRV, """
    Let a service bound to a non-loopback address start without credentials (public services without API
    keys, internal ones without the internal token). Off by default: such a service refuses to start and
    says which setting is missing.""", default=False)
declare("DEEPINFER_TLS_CA", "path", _SRV, """
    PEM file of the certificate authority that signs the mesh's certificates. Set with `DEEPINFER_TLS_CERT`
    and `DEEPINFER_TLS_KEY` it turns on mutual TLS: every gRPC server of a service listens with TLS,
    internal services accept only clients presenting a certificate this CA signed, and every internal
    channel presents the service's certificate and verifies the server's against this CA. The balancer's
    public port (`deepinfer.v1.Generation`) uses TLS but asks public clients for no certificate (API keys
    authenticate them). Set alone, it is for clients (`deepinfer generate`, health probes of the public
    port). `deepinfer certs DIR` makes a development CA and the services' certificates. Unset: plaintext
    gRPC. Files are read when a server starts or a channel opens: rotate certificates with a restart.""")
declare("DEEPINFER_TLS_CERT", "path", _SRV, """
    PEM certificate (chain) of this service, used both as its server certificate and as its client
    certificate on the mesh's internal channels: it needs the serverAuth and clientAuth extended key
    usages and, as subject alternative names, every name the other services dial it by (`deepinfer certs`
    adds `localhost`, `127.0.0.1`, the service's name and each `--host`). Needs `DEEPINFER_TLS_KEY` and
    `DEEPINFER_TLS_CA`.""")
declare("DEEPINFER_TLS_KEY", "path", _SRV, """
    PEM private key of `DEEPINFER_TLS_CERT` (keep it readable by the service only, mode 0600).""")
declare("DEEPINFER_MAX_REQUEST_BYTES", "int", _SRV, """
    Largest HTTP request body the balancer reads; a larger one is refused with 413 before it is parsed.""",
    default=4 * 1024**2, default_doc="`4194304` (4 MiB)", minimum=1024)
declare("DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH", "path", _SRV, """
    A directory whose files the balancer may read as images: an `image_url` content part of an OpenAI chat
    request may then name a local path or `file://` URL inside it. Unset: only `data:` URLs are accepted.
    Images are never fetched over the network (`http(s)://` URLs are refused with 400).""", must_be_dir=True)
declare("DEEPINFER_MAX_TEMPERATURE", "float", _SRV, """
    Largest sampling temperature a request may ask for (finite values only); above it the request is
    refused with 400 / INVALID_ARGUMENT.""", default=100.0, minimum=0.0)
declare("DEEPINFER_DEFAULT_MAX_TOKENS", "int", _SRV, """
    Cap on the generated tokens of a request that gives no `max_tokens`: it gets what the context leaves
    after its prompt, at most this many.""", default=16384, minimum=1)
declare("DEEPINFER_MIGRATION_LIMIT", "int", _SRV, """
    How many times the balancer may move one request to another replica (or to the restarted one) after
    its replica failed mid-stream; the request resumes from its prompt plus the tokens already streamed,
    so the client sees one uninterrupted stream. 0 turns migration off (the stream then ends with an
    error).""", default=3, minimum=0)
declare("DEEPINFER_MIGRATION_WAIT_S", "float", _SRV, """
    How long a request whose replica failed may wait for a replica to serve again (another one, or the same
    one restarted) before it fails with UNAVAILABLE; never longer than the request's own deadline.""",
    default=120.0, minimum=0.0)
declare("DEEPINFER_REBALANCE_INTERVAL_S", "float", _SRV, """
    Rebalancing (docs/routing.md): every this many seconds the balancer compares the requests it has in flight on
    each replica that decodes and, where the busiest has `DEEPINFER_REBALANCE_MIN_GAP` more than the idlest, has the
    busiest hand half the gap off (those with the most tokens left): their state goes through the kvstore and they
    continue on the idlest, not recomputed. 0: off. The replicas need a kvstore (`DEEPINFER_KVSTORE_URL`).""",
    default=0.0, minimum=0.0)
declare("DEEPINFER_REBALANCE_MIN_GAP", "int", _SRV, """
    Rebalancing: the least difference in requests in flight between the busiest and the idlest decoding replica
    that moves requests (at least 2; see `DEEPINFER_REBALANCE_INTERVAL_S`).""", default=4, minimum=2)
declare("DEEPINFER_REPLICA_PROBE_S", "float", _SRV, """
    Period of the balancer's health probes of its scheduler replicas. A replica whose probe or stream
    fails leaves routing at once and comes back when a probe finds it SERVING again.""",
    default=0.5, minimum=0.01)
declare("DEEPINFER_REPLICA_SESSIONS", "bool", _SRV, """
    Whether the balancer sends its requests to a replica over one `Session` stream (each engine step's
    tokens of all of them in one message) instead of one `Submit` call per request, where the replica takes
    session streams. Off: a call per request, which costs the replica and the balancer a message and a
    task switch per running request per step.""", default=True)
declare("DEEPINFER_ROUTER_LOAD_TOKENS", "int", _SRV, """
    Cache-aware routing (docs/routing.md): what one request in flight on a replica weighs against the prompt tokens
    a replica would not have to prefill. The balancer sends a request to the replica with the least
    `prompt tokens - tokens its prefix cache holds + DEEPINFER_ROUTER_LOAD_TOKENS x requests in flight there`.
    Larger: load counts more than cache hits.""", default=1024, minimum=0)
declare("DEEPINFER_ROUTER_POLICY", "enum", _SRV, """
    How the balancer picks a replica for a request (docs/routing.md): `cache` (by the prompt tokens each replica's
    prefix cache holds against its load, then by session, then by load), `load` (the fewest requests in flight) or
    `round_robin`. The replicas of a request's other samples (`n` > 1) and the roles of disaggregation apply under
    every policy; `load` and `round_robin` are there to measure `cache` against.""",
    choices=("cache", "load", "round_robin"), default="cache")
declare("DEEPINFER_RESTART_MAX_BACKOFF_S", "float", _SRV, """
    `deepinfer up` restarts a service that exits unexpectedly, waiting 0.5 s before the first restart and
    doubling the wait for each further crash of the same service within a minute, up to this.""",
    default=30.0, minimum=0.0)
# fmt: on
