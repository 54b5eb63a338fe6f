"""The GCP provider (google-cloud-compute, imported only here): catalog, offers, network and keys, launch."""
