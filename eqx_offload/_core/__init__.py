"""The pieces every other part builds on: errors, types, where leaves are and moving them."""
