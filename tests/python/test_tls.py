"""The Python client against a daemon on TCP, which speaks TLS only: the
real daemon with certificates made by openssl for this test."""
import os
import re
import shutil
import subprocess
import tempfile
import time
import unittest

import optimd
from optimd.client import Client
from optimd.testing import find_binary


def openssl(cwd, *args):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True,
                   capture_output=True)


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="optimd-tls-")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
              "-nodes"]
        for ca in ("ca", "other"):
            openssl(cls.dir, "req", "-x509", *ec, "-days", "1", "-subj",
                    "/CN=" + ca, "-keyout", ca + ".key", "-out", ca + ".pem")
        with open(os.path.join(cls.dir, "server.ext"), "w") as f:
            f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl(cls.dir, "req", *ec, "-subj", "/CN=server", "-keyout",
                "server.key", "-out", "server.csr")
        openssl(cls.dir, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem",
                "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-out",
                "server.pem", "-extfile", "server.ext")
        cls.token = "fedcba9876543210fedcba9876543210"
        fd = os.open(cls.path("admin-token"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, cls.token.encode())
        os.close(fd)
        cls.log = open(os.path.join(cls.dir, "daemon.log"), "w+")
        cls.daemon = subprocess.Popen(
            [find_binary(), "--listen=127.0.0.1:0", "--backend=cpu",
             "--cpu_threads=1", "--tls_cert=" + cls.path("server.pem"),
             "--tls_key=" + cls.path("server.key"),
             "--admin_token_file=" + cls.path("admin-token")],
            stderr=cls.log)
        deadline = time.time() + 20
        cls.address = None
        while time.time() < deadline and cls.address is None:
            cls.log.seek(0)
            m = re.search(r"listening on (127\.0\.0\.1:\d+)", cls.log.read())
            if m:
                cls.address = m.group(1)
            time.sleep(0.02)
        assert cls.address, "the daemon did not start"

    @classmethod
    def tearDownClass(cls):
        cls.daemon.terminate()
        assert cls.daemon.wait(timeout=30) == 0
        cls.log.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name)

    def test_admin_calls_need_the_admin_token(self):
        ca = self.path("ca.pem")
        with Client(self.address, tls_ca=ca) as c:
            with self.assertRaisesRegex(optimd.PermissionDeniedError,
                                        "admin call"):
                c.list_sessions()
            c.get_metrics()  # not an admin call
        with Client(self.address, tls_ca=ca, admin_token=self.token) as c:
            self.assertEqual(len(c.list_sessions().sessions), 0)

    def test_sessions_over_tcp_need_the_admin_token(self):
        """This daemon checks no client certificates: an anonymous TLS
        client may read metrics but not open a session (which would let it
        name the node's shared memory and checkpoint files); the admin
        token opens one."""
        ca = self.path("ca.pem")
        with Client(self.address, tls_ca=ca) as c:
            with self.assertRaisesRegex(optimd.PermissionDeniedError,
                                        "tls_client_ca"):
                c.create_session("tcp-job")
            self.assertEqual(c.get_metrics().sessions, 0)
        with Client(self.address, tls_ca=ca, admin_token=self.token) as c:
            c.create_session("tcp-job")
            self.assertEqual(c.get_metrics().sessions, 1)
            c.close_session()

    def test_client_with_the_ca_connects(self):
        with Client(self.address, tls_ca=self.path("ca.pem")) as c:
            self.assertEqual(c.get_metrics().sessions, 0)

    def test_the_ca_may_come_from_the_environment(self):
        os.environ["OPTIMD_TLS_CA"] = self.path("ca.pem")
        try:
            with Client(self.address) as c:
                self.assertEqual(c.get_metrics().sessions, 0)
        finally:
            del os.environ["OPTIMD_TLS_CA"]

    def test_clear_errors_without_tls(self):
        os.environ.pop("OPTIMD_TLS_CA", None)
        with self.assertRaises(optimd.InvalidArgumentError) as cm:
            Client(self.address)
        self.assertIn("TLS", str(cm.exception))
        with self.assertRaises(optimd.InvalidArgumentError) as cm:
            Client(self.address, tls_ca=self.path("server.ext"))
        self.assertIn("not PEM", str(cm.exception))
        # A CA that did not sign the daemon's certificate: no connection.
        with self.assertRaises(optimd.DaemonUnavailableError):
            Client(self.address, tls_ca=self.path("other.pem"),
                   connect_timeout=2)


if __name__ == "__main__":
    unittest.main()
