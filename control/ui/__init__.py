"""The web dashboard the controlplane serves under `/ui/`: its pages, static files and session."""
