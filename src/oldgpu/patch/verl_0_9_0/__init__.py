"""verl 0.9.0's patch sets: ``base`` for every profile, then ``base16`` (a LoRA base stored
at 16 bits), ``cpu`` for cpu trees and ``logits`` (the response's logits only) for every
profile. The registry reads ``base`` first, the rest in name order."""
