"""Security: tenant isolation, hostile writers, signed values and quotas through pods."""
