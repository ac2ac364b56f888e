"""Code shared by every HyAtlas service: settings, errors, gRPC plumbing, layer names."""
