"""`python -m sim.kubeapi DIR [--nodes N --pods-per-node M]` (see `sim.kubeapi.http.main`)."""

from sim.kubeapi.http import main

main()
