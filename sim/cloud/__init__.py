"""Stand-ins for the cloud CLIs (gcloud, kubectl, aws, skopeo) that `deploy/attach-gke-pool.sh`
drives.

The executables beside this file are thin bash wrappers around `standin.py`; see its docstring
for what is modelled and why.
"""
