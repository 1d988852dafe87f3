"""verl 0.9.0's patch sets: ``base`` for every profile, then ``base16`` (a LoRA base stored
at 16 bits), ``cpu`` for cpu trees, ``logits`` (the response's logits only) and ``rollout``
(no weight export for a rollout in the trainer's process) for every profile. The registry
reads ``base`` first, the rest in name order."""
