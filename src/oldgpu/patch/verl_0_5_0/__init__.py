"""verl 0.5.0's patch sets: ``base`` for every profile, then the sets that join for some
options (``cpu``, ``fp16``, ``logits``). The registry reads ``base`` first, the rest in
name order."""
