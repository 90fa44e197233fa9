//! Overload ladder (filled in next).
