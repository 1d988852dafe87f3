"""verl 0.9.0's patch sets: ``base`` for every profile, then ``cpu`` for cpu trees. The
registry reads ``base`` first, the rest in name order."""
