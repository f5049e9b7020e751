"""The pool's single address: a gateway in front of N sampler replicas.

A trainer samples from many replicas at once. Behind a plain Service three things break: a future
submitted on replica A is retrieved from replica B (404), a replica being drained or reloaded
still gets traffic, and during a weights rollout a request may land on the old version. This
gateway fixes all three with the shape of the Gateway API Inference Extension (an InferencePool
of endpoints plus an endpoint picker), adding what it lacks: a weights-version policy and ids that
name their replica.

Read top-down. Each package owns one concern and imports only packages below it
(tests/unit/test_layers.py); its `__init__` says what it owns:

    __main__      starts the gateway: flags, the discovery source, the switch's Lease, the socket
    app           the FastAPI application, assembled in one place
    routes/       thin routes per protocol: native, OpenAI, Tinker, Twinkle, the pool's admin, probes
    server/       the gateway as one of several behind one address: a shared port, who answered
    admin/        the pool's admin side: weights and adapter pushes, the SamplerPool object
    forwarding/   a request's life: picked, sent, retried; owned work sent to its owner
    lora/         a request for an adapter version: what the name means, where it goes, loading it
    discovery/    where the replica set comes from, and the refresh loop that publishes it
    routing/      which replicas may answer and which takes a request: the live pool, the version
                  policy, the pool's routing switch, the endpoint scorer and its prefix index, the
                  least-loaded picker, sticky sessions
    admission/    admission and fairness once the pool is full
    upstream/     one HTTP exchange with one replica, over the gateway's HTTP/1.1 client
    replicas/     the replica set as pure data: each replica's view, its adapters, ids that name it
    metrics/      what the gateway measures
    kube/         its own Kubernetes client and the Events it posts
    config.py     every flag (a leaf)
    errors.py     the gateway's own failures, each with its status and category (a leaf)

`errors.py` sits at the root beside `config.py` for the same reason: both are leaves that every
package from routing/ up reads, and neither belongs to one of them. Every decision is a pure
function; routes and the pool only call them.
"""

__version__ = "0.1.0"
