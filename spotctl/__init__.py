"""spotctl: keep elastic PyTorch training alive and progressing on spot VMs."""

__version__ = "0.1.0"
