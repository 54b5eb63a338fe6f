"""The AWS provider (boto3, imported only here): catalog, offers, network and keys, launch."""
