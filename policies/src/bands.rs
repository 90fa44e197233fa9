//! Criticality bands (filled in next).
