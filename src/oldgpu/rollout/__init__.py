"""A Pascal rollout for verl >= 0.7: an HF-transformers server that verl's agent loop drives.

verl 0.9.0 accepts only asynchronous rollout servers (vLLM, SGLang, TRT-LLM), none of
which runs on a CC < 7.0 card. This package is one more server of that kind, written
against verl's interfaces and registered from outside verl's tree
(``VERL_USE_EXTERNAL_MODULES=oldgpu.verl_plugin.hook``), never by editing verl:

- ``sampling``: verl's sampling params and length limits -> one generation request
  (every key honoured or refused by name), and the token/log-prob lists a finished row
  becomes (pure Python);
- ``batching``: requests that arrive together are generated together, within a token
  budget, with timeouts (pure asyncio);
- ``decode``: the decode loop: per-row sampling, finished rows leave the batch, the
  log-probs are those of the distribution sampled from;
- ``hf_engine``: the model (compute dtype and attention from the profile), generation
  on any module handed in (OOM splits the batch), and the trainer's weights copied in;
- ``server``: the Ray actor the agent loop calls (``generate`` -> ``TokenOutput``);
- ``adapter``: the ``BaseRollout`` in the trainer's process that wakes, sleeps and feeds
  the server the weights verl's checkpoint engine hands it;
- ``replica``: the ``RolloutReplica`` that starts one server per replica.

The modules that import verl (server, adapter, replica) are imported only by verl's own
registry lookups; the rest imports neither verl nor Ray.
"""

ROLLOUT_NAME = "oldgpu-hf"
"""``actor_rollout_ref.rollout.name`` that selects this rollout."""
