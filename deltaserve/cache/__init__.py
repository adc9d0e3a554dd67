"""Cache specs (what a layer caches, in which pool) and the pools that hold them."""
