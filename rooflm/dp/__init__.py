"""Data parallelism: N engine cores behind one API process, and the router that picks one.

  router.py    which replica a request goes to (cache-aware, round-robin, least-loaded);
               also the simulator's router (rooflm/sim), so both route the same way
  replicas.py  the N engine-core processes (one GPU or TP group each), started together
  client.py    DPClient: the front end (an EngineClient) over the N cores
  offline.py   `rooflm bench throughput --data-parallel-size N`: N cores over shares of the prompts
"""
