//! Harness for end-to-end runs of real Envoy with the sluice filter.
